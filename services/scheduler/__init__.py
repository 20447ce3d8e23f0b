"""The scheduler: every request's state and the global paged block table."""
