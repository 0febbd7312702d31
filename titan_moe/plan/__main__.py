"""`python -m titan_moe.plan`: see :mod:`titan_moe.plan`."""

from titan_moe.plan.cli import main

main()
