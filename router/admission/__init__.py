"""Who may send what, and when: the gate, tenants and flow control."""
