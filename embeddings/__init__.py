"""Sparse side: feature ids, TorchRec embedding tables, sharding plans and the fused optimizer."""
