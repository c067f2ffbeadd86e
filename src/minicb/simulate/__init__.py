"""The cost-model simulator (``simulator``) and its command line, ``minicb simulate`` (``cli``)."""
