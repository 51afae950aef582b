"""The one read path: atoms back from blobs, a step seen as a model, byte-exact placement, output folders."""
