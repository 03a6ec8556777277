"""Gym-style text games as environments: `--env gym:ID`, a game registered with gymnasium whose observations and actions
are text, in its five-tuple convention (`reset() -> (observation, info)`, `step(text) -> (observation, reward,
terminated, truncated, info)`); `--env textarena:ID`, one of TextArena's single-player games.

Each becomes a step(text) environment (common/envs.py) alive for its episode: its first observation is added to the
prompt's last user message, each model turn is the game's action, the next observation the environment's answer, each
step's reward that turn's reward (turn_reward), and the episode ends when the game does; the game scores every
episode (get_reward), so its rows need no reward function. A row's `seed` column, when it
has one, seeds the game's reset, so that a group's samples play the same game. gymnasium's id may name the module that
registers it first, as `gymnasium.make` reads it (`--env gym:my_games:Guess-v0`).
"""

from __future__ import annotations

PACKAGES = {"gym": ("gymnasium", "gymnasium"), "textarena": ("textarena", "textarena")}  # prefix: (module, pip name)


def gym_env_class(prefix: str, game_id: str, flag: str):
    """The environment class of `--env prefix:game_id`, once the package is there and knows the game."""
    import importlib

    module, package = PACKAGES[prefix]
    try:
        library = importlib.import_module(module)
    except ImportError:
        raise ValueError(f"{flag}: the {package} package is not installed; pip install {package}") from None
    if prefix == "gym":
        registers, _, name = game_id.rpartition(":")
        try:
            if registers:
                importlib.import_module(registers)
            library.spec(name)
        except Exception as error:  # gymnasium's NameNotFound, its VersionNotFound, a module that does not import
            raise ValueError(f"{flag}: gymnasium knows no game {game_id!r} ({error})") from None
        return type(game_id, (GymTextGame,), {"game_id": game_id})
    from textarena.envs.registration import ENV_REGISTRY

    if game_id not in ENV_REGISTRY:
        raise ValueError(f"{flag}: TextArena has no game {game_id!r}; its games: textarena.envs.registration.ENV_REGISTRY")
    return type(game_id, (TextArenaGame,), {"game_id": game_id})


class GymTextGame:
    """A gymnasium game whose observations and actions are text, in the five-tuple convention."""

    game_id = ""

    def reset(self, seed: int | None = None, **row) -> str:
        import gymnasium

        self.game, self.reward = gymnasium.make(self.game_id), None
        observation, _ = self.game.reset(seed=seed)
        return str(observation)

    def step(self, text: str) -> str | float:
        observation, reward, terminated, truncated, _ = self.game.step(text)
        self.reward = float(reward)
        return 0.0 if terminated or truncated else str(observation)  # at its end, the score is its turns' rewards

    def turn_reward(self) -> float | None:
        return self.reward

    def get_reward(self) -> float:
        return 0.0  # the game's rewards are its turns'

    def close(self) -> None:
        self.game.close()


class TextArenaGame:
    """A TextArena game for one player: its observation grows with the game's history, of which each answer is the
    new part; its reward for the player comes when the game ends."""

    game_id = ""
    stop_strings = ["]"]  # TextArena's games read the action in square brackets: `[5]`

    def reset(self, seed: int | None = None, **row) -> str:
        import textarena

        self.game, self.ended, self.score = textarena.make(self.game_id), False, 0.0
        self.game.reset(num_players=1, seed=seed)
        _, observation = self.game.get_observation()
        self.seen = len(observation)
        return observation

    def step(self, text: str) -> str | float:
        done, _ = self.game.step(text)
        if done:
            self.ended = True
            rewards, _ = self.game.close()
            self.score = float((rewards or {}).get(0, 0.0))
            return self.score
        _, observation = self.game.get_observation()
        answer, self.seen = observation[self.seen :], len(observation)
        return answer

    def get_reward(self) -> float:
        return self.score  # 0 for a game the episode did not finish

    def close(self) -> None:
        if not self.ended:
            self.game.close()
