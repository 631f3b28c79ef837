"""The fp64 torch references (recurrent, chunked, decode) and the reference variants built on them."""
