"""Embodied tasks with verifiable rewards (rendered frames + instruction -> answer token)."""
