"""The CLI subcommands, one module each (see ``app.cli``)."""
