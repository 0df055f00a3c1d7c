"""Policy I/O: what a checkpoint's framework does around the network (prompts, tokenizer,
preprocessing, robot adapters, the policy)."""
