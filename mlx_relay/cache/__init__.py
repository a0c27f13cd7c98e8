"""Prefix cache bookkeeping (pure Python): keys and the budgeted LRU index the PrefixCacheStore owns."""
