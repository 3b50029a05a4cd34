"""executor.partition"""
