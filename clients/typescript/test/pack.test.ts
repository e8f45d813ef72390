// The package as a service installs it: npm pack (which builds it, by the
// prepare script), the tarball installed into a fresh project outside
// this repository, and a once() call of that project, as its own node
// process, against a real idemreg serve. issue 39: `npm install` of the
// unbuilt directory failed with ERR_MODULE_NOT_FOUND .../dist/src/index.js.
import assert from "node:assert/strict";
import { execFileSync } from "node:child_process";
import { cpSync, existsSync, mkdirSync, mkdtempSync, rmSync, symlinkSync, writeFileSync } from "node:fs";
import { tmpdir } from "node:os";
import { dirname, join, resolve } from "node:path";
import { fileURLToPath } from "node:url";
import { after, before, test } from "node:test";
import { startRegistry, type Registry } from "./registry.js";

// dist/test/pack.test.js → clients/typescript.
const pkgRoot = resolve(dirname(fileURLToPath(import.meta.url)), "../..");

let reg: Registry;
let tmp: string;
before(async () => {
  reg = await startRegistry();
  tmp = mkdtempSync(join(tmpdir(), "idemreg-ts-pack-"));
});
after(async () => {
  await reg?.stop();
  if (tmp) rmSync(tmp, { recursive: true, force: true });
});

// The project's program: once() twice on one key, through the package's
// two entry points, printing what each returned.
const program = `
import { RegistryClient } from "@idemreg/client";
import { createNodeTransport } from "@idemreg/client/node";
const [baseUrl, key] = process.argv.slice(2);
const reg = new RegistryClient(createNodeTransport({ baseUrl }));
let runs = 0;
const out = [];
for (let i = 0; i < 2; i++) {
  const r = await reg.once({ consumer: "ts.pack", key }, async (a) => ({ runs: ++runs, token: String(a.token) }));
  out.push({ ran: r.ran, replayed: r.replayed, value: r.value });
}
console.log(JSON.stringify(out));
`;

test("npm pack, installed from the tarball into a fresh project: once() runs, then replays", { timeout: 300_000 }, () => {
  // Packed from a copy of the sources without dist/, as a fresh checkout
  // is: only prepare can build what the tarball ships.
  const checkout = join(tmp, "checkout");
  mkdirSync(checkout);
  for (const f of ["package.json", "package-lock.json", "tsconfig.json", "README.md", "src"]) {
    cpSync(join(pkgRoot, f), join(checkout, f), { recursive: true });
  }
  symlinkSync(join(pkgRoot, "node_modules"), join(checkout, "node_modules"));
  const packed = JSON.parse(
    execFileSync("npm", ["pack", "--json", "--pack-destination", tmp], { cwd: checkout, encoding: "utf8", stdio: ["ignore", "pipe", "inherit"] }),
  ) as { filename: string; files: { path: string }[] }[];
  assert.equal(packed.length, 1);
  const files = packed[0].files.map((f) => f.path);
  assert.ok(files.includes("dist/src/index.js"), `built before packing (prepare): ${files.join(", ")}`);
  assert.ok(files.includes("dist/src/node.d.ts"), "with its types");
  for (const f of files) {
    assert.ok(f.startsWith("dist/src/") || ["package.json", "README.md"].includes(f), `only the built package ships: ${f}`);
  }

  const app = join(tmp, "app");
  mkdirSync(app);
  writeFileSync(join(app, "package.json"), JSON.stringify({ name: "pack-test-app", private: true, type: "module" }));
  // --prefer-offline: the dependencies come from npm's cache, which
  // npm ci in this directory filled, when they are there.
  execFileSync("npm", ["install", "--no-audit", "--no-fund", "--prefer-offline", join(tmp, packed[0].filename)], {
    cwd: app,
    stdio: ["ignore", "ignore", "inherit"],
  });
  const installed = join(app, "node_modules", "@idemreg", "client");
  assert.ok(existsSync(join(installed, "dist", "src", "index.js")));
  assert.ok(!existsSync(join(installed, "src")), "a copy of the tarball, not a link to this checkout");
  writeFileSync(join(app, "main.js"), program);

  const out = JSON.parse(
    execFileSync(process.execPath, ["main.js", reg.baseUrl, `k-${process.pid}`], { cwd: app, encoding: "utf8" }),
  ) as { ran: boolean; replayed: boolean; value: { runs: number; token: string } }[];
  assert.equal(out[0].ran, true);
  assert.equal(out[0].value.runs, 1);
  assert.match(out[0].value.token, /^[1-9][0-9]*$/);
  assert.equal(out[1].replayed, true);
  assert.deepEqual(out[1].value, out[0].value, "the second call replays the first's value");
});
