"""Plugging tailorstore into training loops: the HF Trainer (``hf``) and DeepSpeed (``deepspeed``)."""
