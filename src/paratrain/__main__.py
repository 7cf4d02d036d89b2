from paratrain.cli import run

run()
