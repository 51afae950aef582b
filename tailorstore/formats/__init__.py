"""Formats: how each framework's files are read into atoms and written back (DeepSpeed, the torch zip
and its pickle, safetensors, DCP), with no knowledge of the store. The layer below ``ingest`` and
``restore``; docs/ARCHITECTURE.md draws the layers."""
