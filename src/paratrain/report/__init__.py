"""Rank-aware logging, progress, metrics files and summaries (rank 0 speaks)."""
