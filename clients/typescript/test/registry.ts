// A real `idemreg serve` for the tests: the binary built from this
// checkout (or IDEMREG_BIN), on a free loopback port, with the embedded
// store in a temporary directory.
import { execFileSync, spawn, type ChildProcess } from "node:child_process";
import { mkdtempSync, rmSync } from "node:fs";
import { createServer } from "node:net";
import { tmpdir } from "node:os";
import { dirname, join, resolve } from "node:path";
import { fileURLToPath } from "node:url";
import { Code } from "@connectrpc/connect";
import { RegistryClient, fromError } from "../src/index.js";
import { createNodeTransport } from "../src/node.js";

// dist/test/registry.js → the repository's root.
const repoRoot = resolve(dirname(fileURLToPath(import.meta.url)), "../../../..");

let built: string | undefined;

function binary(): string {
  if (process.env.IDEMREG_BIN) {
    return process.env.IDEMREG_BIN;
  }
  if (!built) {
    const dir = mkdtempSync(join(tmpdir(), "idemreg-ts-bin-"));
    built = join(dir, "idemreg");
    execFileSync("go", ["build", "-o", built, "./cmd/idemreg"], { cwd: repoRoot, stdio: "inherit" });
  }
  return built;
}

function freePort(): Promise<number> {
  return new Promise((res, rej) => {
    const s = createServer();
    s.once("error", rej);
    s.listen(0, "127.0.0.1", () => {
      const addr = s.address();
      s.close(() => (typeof addr === "object" && addr ? res(addr.port) : rej(new Error("no port"))));
    });
  });
}

export interface Registry {
  baseUrl: string;
  client: RegistryClient;
  /** Another client of the same registry: another process, as far as the registry can tell. */
  newClient(): RegistryClient;
  stop(): Promise<void>;
}

/** Starts idemreg serve and waits until it answers. */
export async function startRegistry(extraArgs: string[] = []): Promise<Registry> {
  const bin = binary();
  const port = await freePort();
  const dataDir = mkdtempSync(join(tmpdir(), "idemreg-ts-data-"));
  // The registry's own environment variables would override nothing (flags
  // win) but could add settings: leave them out.
  const env = Object.fromEntries(Object.entries(process.env).filter(([k]) => !k.startsWith("IDEMREG_")));
  const proc: ChildProcess = spawn(
    bin,
    ["serve", "--listen", `127.0.0.1:${port}`, "--data-dir", dataDir, "--min-lease", "100ms", "--log-level", "error", ...extraArgs],
    { env, stdio: ["ignore", "inherit", "inherit"] },
  );
  let exited = false;
  proc.once("exit", () => (exited = true));
  const baseUrl = `http://127.0.0.1:${port}`;
  const newClient = () => new RegistryClient(createNodeTransport({ baseUrl }));
  const client = newClient();
  const deadline = Date.now() + 30_000;
  for (;;) {
    if (exited) {
      throw new Error("idemreg serve exited before it answered");
    }
    try {
      await client.lookup({ consumer: "ready", key: "probe" }, { timeoutMs: 1000 });
      break;
    } catch (e) {
      if (fromError(e).code === Code.NotFound) {
        break;
      }
      if (Date.now() > deadline) {
        proc.kill("SIGKILL");
        throw e;
      }
      await new Promise((r) => setTimeout(r, 50));
    }
  }
  return {
    baseUrl,
    client,
    newClient,
    stop: async () => {
      if (!exited) {
        const gone = new Promise((r) => proc.once("exit", r));
        proc.kill("SIGTERM");
        await gone;
      }
      rmSync(dataDir, { recursive: true, force: true });
    },
  };
}
