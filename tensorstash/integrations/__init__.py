"""tensorstash inside other training code: Lightning (lightning), the HF Trainer (hf),
and torch.distributed (distributed). Each needs its library only when imported."""
