"""Hugging Face safetensors in and out.

    adapter.py   torchtitan's `StateDictAdapter` for our model: the names of our own HF
                 layout, the shard plan, config.json. With it, torchtitan's
                 `checkpoint.last_save_in_hf` and `checkpoint.initial_load_in_hf` work.
    files.py     read and write a sharded safetensors folder (index json, config json)
                 without DCP, for converters and tests.
    mxfp4.py     OCP MX FP4 (E2M1 values, E8M0 block scales) dequantization.
    kimi_k3.py   import of the public Kimi K3 checkpoint layout into our model.
    __main__.py  `python -m titan_moe.hf import-k3 SRC DST`.

See docs/hf.md for the layouts and what is assumed.
"""
