"""The `disagmoe` command line (typer). Nothing else in the package imports this."""
