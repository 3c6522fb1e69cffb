"""The `viasd` command-line interface (installed as the import package `viasd_cli`)."""
