"""The ``tailor`` command line, a thin shell over the library (installed as tailorstore.cli)."""
