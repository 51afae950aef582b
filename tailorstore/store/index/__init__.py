"""The store's index: SQLite (the one module with SQL, _index.py), its schema, and the protocols
(catalogue.py) that say what operations may ask of it and change in it. The typed records it holds
are core's (core/records.py): every layer speaks them. It imports only core (tests/system/test_layers.py)."""
