"""Who a client is: principals from certificates, the PROXY header, SASL."""
