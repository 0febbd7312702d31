"""`python -m titan_moe.export`: see `titan_moe.export.cli`."""

from titan_moe.export.cli import main

if __name__ == "__main__":
    main()
