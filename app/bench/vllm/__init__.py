"""The benchmarks' vLLM side: vLLM's own kernels and whole vLLM CPU engines, run in the vLLM
virtualenv the user names (``--vllm-python``), beside ours.

- ``prefill``: vLLM's CPU prefill attention (``bench vllm-prefill``) and the shared worker
  plumbing (the vLLM python, the CPU's name, loading a worker's JSON);
- ``decode``: vLLM's CPU MLA decode beside ours (``bench decode --baseline vllm``);
- ``engine`` / ``engine_worker``: whole vLLM engines, its backends vs ours plugged in
  (``bench vllm-engine``; ``python -m app.bench.vllm.engine_worker`` runs in the vLLM venv);
- ``model``: one whole vLLM engine kept for ``bench model --baseline vllm``.

Nothing here imports vLLM at import time.
"""
