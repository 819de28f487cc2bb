"""`dayzero bench`: measurements that print a table and a final summary line."""
