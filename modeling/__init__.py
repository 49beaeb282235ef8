"""The policy network: loading a model and its attention kernel (models.py), the training
forward's log-probs (logprobs.py), LoRA adapters (lora.py)."""
