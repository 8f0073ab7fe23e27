"""iterserve.cluster"""
