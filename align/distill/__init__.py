"""Streak distillation: windows of verifier rollouts, the losses, and DeepSpeed as the training engine."""
