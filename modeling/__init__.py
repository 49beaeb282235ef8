"""The policy network: loading a model and its attention kernel (modeling/models.py), the training
forward's log-probs (modeling/logprobs.py), LoRA adapters (modeling/lora.py)."""
