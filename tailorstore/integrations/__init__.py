"""Training loops' adapters, by framework: ``common`` (ranks, sessions, the seam), ``deepspeed``, ``dcp``, ``hf``."""
