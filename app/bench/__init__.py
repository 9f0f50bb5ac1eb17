"""Benchmarks behind ``python -m app bench NAME`` (JSON results; never timed unit tests).

Each module has ``HELP``, ``add_arguments(parser)``, ``run(args) -> dict`` and
``render(result) -> str``. ``app.bench._timing`` has the shared timing helpers.
"""
