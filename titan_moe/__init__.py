"""titan_moe: a torchtitan-based trainer for hybrid KDA/MLA sparse MoE language models.

Entry points: `python -m titan_moe.train`, `titan_moe.inspect`, `titan_moe.plan`,
`titan_moe.generate`, `titan_moe.export`. The model lives in `titan_moe.model`, its custom
ops in `titan_moe.ops`.
"""

__version__ = "0.1.0"
