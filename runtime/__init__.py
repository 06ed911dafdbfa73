"""Runtime: host weight store, device weight pool, schedule executor."""
