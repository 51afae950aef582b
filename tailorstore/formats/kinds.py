"""How a file is stored (``files.kind``): kept whole, or cut into atoms around a container.

Kept apart from the readers so that checkout and verify can name the kinds without
importing torch, which the readers need."""

RAW = "raw"  # kept whole, as one blob
TORCH = "torch"  # a torch.save zip: skeleton pickle plus tensor records
SAFETENSORS = "safetensors"  # a JSON header plus tensor bytes
DCP = "dcp"  # a DCP .distcp file: torch.save zips back to back, each tensor item an atom
