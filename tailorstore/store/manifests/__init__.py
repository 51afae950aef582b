"""Manifests as immutable objects in the backend, so the SQLite index is only a cache.

One module a job: ``keys`` (what every object and ref is named), ``document`` (a manifest
object's bytes), ``objects`` (publishing and deleting them, in the order store/publish.py calls),
``refs`` (tag and pin objects), ``drop_marks`` (gc's drops against ref changes), ``runs`` (run
and retention objects) and ``sync`` (the index brought up to date with the backend).
"""
