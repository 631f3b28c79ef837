"""FLA frontend (trace-time substitutions of FLA op calls) -- being written."""
