"""Model building blocks: linear, norm, rotary, activation, embedding, sampler."""
