"""``python -m app bench sparse``: DeepSeek Sparse Attention on the CPU against dense attention
(:mod:`app.bench.sparse.bench`)."""

__all__: list[str] = []
