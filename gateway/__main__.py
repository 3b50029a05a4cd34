import sys

from agentserve.gateway.process import main

sys.exit(main())
