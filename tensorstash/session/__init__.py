"""The session: the one place that pushes saved-tensor hooks (stash), the modules that
run inside it (_modules), DTensor's local parts (_dtensor) and ``verify`` (_verify)."""
