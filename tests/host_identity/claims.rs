//! Who a remote peer is: its claim in its proven key's namespace (findings 1 and 9).
