"""Phase-aware memory: the analytic planner (`plan-memory`)."""
