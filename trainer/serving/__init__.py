"""Serving: a trained model as one artifact that plain PyTorch loads (`rankmix export`),
and scoring with it (`rankmix score --model`)."""
