"""The `kvpool` command: one module per subcommand, each with add_parser() and run(); main.py wires them."""
