"""executor.attention"""
