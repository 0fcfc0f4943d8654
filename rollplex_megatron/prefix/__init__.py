"""Prefix stage / response stage execution around megatron's pipeline schedule."""
