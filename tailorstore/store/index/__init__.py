"""The store's index: SQLite (the one module with SQL, _index.py), its schema, the typed records it
holds, and the protocols (catalogue.py) that say what operations may ask of it and change in it."""
