"""Multi-LoRA serving in the worker (issue 34): adapters read from PEFT files, resident in fixed
slots of every targeted linear layer, applied per token in a mixed batch."""
