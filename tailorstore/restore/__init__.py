"""Writing stored steps back out: checkout, another world size, the universal layout, export."""
