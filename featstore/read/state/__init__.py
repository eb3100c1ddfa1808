"""Where a reader is: its placement (rank, world size), the epochs and resume points it shares
with its DataLoader workers, and the one typed resume state every saver writes and every loader reads.
"""
