"""Reading a checkpoint into a model: its config and tensors (memory-mapped safetensors, sources
joined or split per parameter), quantized checkpoints as the float ones they stand for, the shipped
default model, and seeded random checkpoints of every supported architecture."""
