"""iterserve.bench"""
