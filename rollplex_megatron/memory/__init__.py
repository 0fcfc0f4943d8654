"""Phase-aware memory: the planner (`plan-memory`, the trainer's budget check) and the run-time manager."""
